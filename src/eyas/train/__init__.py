"""EAGLE-3 draft training: data and loss masks, draft vocabulary, target hidden-state capture and dumps, TTT loss."""
