"""What the package does to a host besides installing files: prepare-host (directories, terminal relay key)."""
