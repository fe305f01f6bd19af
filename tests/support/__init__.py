"""What several test files share: fake worker groups, small tasks named by import path, a real S3 on
loopback, and the fault tests' job. Test modules import from here, never from one another."""
