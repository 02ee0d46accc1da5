"""Exploration planners (bandit, uniform, greedy, none) behind one small interface (design.md §3.4).

Empty so far: seed exploration is its own issue.
"""
