"""Remediation: turning incidents into restarts, and measuring what they cost (goodput)."""
