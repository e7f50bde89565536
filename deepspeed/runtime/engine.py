class DeepSpeedEngine:
    pass
