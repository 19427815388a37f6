"""Lossless gradient compression: sufficient-factor broadcasting, placed where a MILP selection says it pays."""
