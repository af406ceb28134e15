"""prompt stage of mmferry."""
