"""The headline benchmark (`bench`): disaggregated against colocated workers, by capacity
search and goodput, with its report and plots; and the shifting workload (`shifting`):
elastic roles against the static split and 2 mixed workers as the traffic mix moves."""
