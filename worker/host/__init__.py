"""The host a CPU worker runs on: its cores (affinity, cgroup quota) and the threads chosen
for them, the OpenMP wait policy, and CPU features that need more than a cpuinfo flag (AMX)."""
