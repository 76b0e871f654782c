"""Drafters (the registry names them all), the head's context K/V, and which drafter fits a head."""
