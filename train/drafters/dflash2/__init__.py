"""DFlash2: DFlash with convolutional sublayers and a learned path selector."""
