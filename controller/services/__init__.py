"""Glue: services that feed the pure logic (controller.logic) with state and carry out
its decisions."""
