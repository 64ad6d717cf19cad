"""Memory saving: rematerialization (rotor), activation offloading, memory accounting."""
