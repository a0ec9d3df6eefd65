"""Command-line benchmarks (`gradshare bench ...`); scripts in benchmarks/ call these too."""
