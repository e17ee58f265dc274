"""Batch planning: the CP-SAT packing model, its greedy warm start and the background planner.

`model.solve_batch` plans a batch of pending pods on a `capacity.Capacity` snapshot;
`background.BackgroundPlanner` keeps such a plan for the server (`PlanSource`);
`greedy` holds the one-pod rules (vramsched's and the simulator's baselines).
"""
