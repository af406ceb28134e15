"""preprocess stage of mmferry."""
