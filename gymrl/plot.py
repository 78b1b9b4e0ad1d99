"""`python -m gymrl.plot`: the command; the code is `gymrl.tracking.plot`."""

from gymrl.tracking.plot import main

if __name__ == "__main__":
    main()
