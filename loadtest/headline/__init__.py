"""The headline benchmark (`bench`): disaggregated against colocated workers, by capacity
search and goodput, with its report and plots."""
