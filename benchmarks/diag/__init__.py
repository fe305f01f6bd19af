"""One-off diagnostics: each answers one question about where the product's time goes (not peer
comparisons)."""
