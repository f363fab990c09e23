"""Trained draft heads: the modules `tandem train` optimises and the head drafters serve."""
