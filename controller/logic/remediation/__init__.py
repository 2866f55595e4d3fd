"""Remediation decisions: rules, guards, restart planning and the goodput ledger."""
