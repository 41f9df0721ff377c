"""The what-if tools: estimate/ (memory at any world size), simulate/ (a measured run
re-timed), predict/ (the virtual GPU); cells.py holds what estimate and predict share."""
