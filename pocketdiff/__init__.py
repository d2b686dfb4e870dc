"""pocketdiff: make Stable-Diffusion-family models phone-ready."""

__version__ = "0.1.0"
