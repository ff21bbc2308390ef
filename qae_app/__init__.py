"""qae: RL from verifiable rewards with Quantile Advantage Estimation (arXiv 2509.22611), and the tools to watch it.

Nothing is imported here, so `qae --help`, `qae runs` and the dashboard stay free of torch; see README.md.
"""
