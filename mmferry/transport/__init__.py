"""transport stage of mmferry."""
