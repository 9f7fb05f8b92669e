"""What a run leaves and shows: report folders (samples.csv, summary.json, plots) and what a
terminal draws."""
