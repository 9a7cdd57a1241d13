"""Evaluation of drafts: acceptance through the real engine."""
