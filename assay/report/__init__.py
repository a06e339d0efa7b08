"""Self-contained HTML reports of assay run folders."""
