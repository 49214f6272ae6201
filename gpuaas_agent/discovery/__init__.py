"""Pure readers of host topology (sysfs, /dev, /proc, udev) and the candidate slot planner. No side effects."""
