"""Requests in and outputs out: tokenizing, validating, chat templates, detokenizing, stop strings,
routing outputs."""
