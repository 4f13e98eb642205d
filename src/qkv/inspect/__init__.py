"""Inspection: the article's steps traced with a real model's real numbers."""
