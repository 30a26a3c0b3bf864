"""`kvlane bench`: workloads sent to a live local fleet, timed per token, and the reports made of them."""
