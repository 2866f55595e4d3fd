"""The controller side of traffic planning: fabric, versioned plans, link health, API views."""
