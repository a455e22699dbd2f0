"""Input: host data into global arrays laid out on a mesh."""
