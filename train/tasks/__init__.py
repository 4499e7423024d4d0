"""Synthetic task families with controlled difficulty (the looped-LM lab, `train/lab.py`)."""
