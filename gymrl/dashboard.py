"""`python -m gymrl.dashboard`: the command; the code is `gymrl.tracking.dashboard`."""

from gymrl.tracking.dashboard import main

if __name__ == "__main__":
    main()
