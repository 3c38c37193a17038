"""The board: what a row is ranked by, the results table, the leaderboard with the best adapter
copied, the adapter soup and the plots.
"""
