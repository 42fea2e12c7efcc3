"""What to run here: hardware, calibration and speed, the planner, the catalog, the hub, other tools' models, demo and starter models."""
