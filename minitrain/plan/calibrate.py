def load_machine(name=None):
    return {"name": "stub"}
