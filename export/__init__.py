"""pocketdiff.export"""
