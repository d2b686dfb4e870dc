"""pocketdiff.compress"""
