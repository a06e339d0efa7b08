"""One module per CLI command: turns a config into a run folder, calls the library, prints the result."""
