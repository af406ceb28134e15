"""embed stage of mmferry."""
