"""Scheduling: the scheduler, its step plan, queues, request table and stop checks."""
