"""pocketdiff.train"""
