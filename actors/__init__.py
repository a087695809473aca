"""Ray actors and Serve deployments; thin wrappers over engine/."""
