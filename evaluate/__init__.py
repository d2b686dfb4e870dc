"""pocketdiff.evaluate"""
