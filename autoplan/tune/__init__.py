"""`autoplan tune`: run the search's best candidates for real, refit the cluster's constants to what was
measured, and choose the plan by measurement (see `autoplan.tune.core`)."""
