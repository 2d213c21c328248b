"""Converting other frameworks' run commands into rlctl job files (verl's Hydra overrides).
"""
