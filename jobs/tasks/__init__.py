"""Example tasks: ``charlm`` (a character-level Transformer on the Python standard library's source)
and ``tabular`` (an MLP classifier over a Parquet dataset)."""
