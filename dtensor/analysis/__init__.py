"""Analysis of compiled steps: explain, HLO collectives, memory per chip."""
