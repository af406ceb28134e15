"""encoder stage of mmferry."""
