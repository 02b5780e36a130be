"""Scoring on the private test split: evaluators, budgets, noise keys, final evaluation, the kept model's score."""
