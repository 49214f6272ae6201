"""Side-effect drivers, one file each; they act only after the guards in ``guards/`` passed."""
