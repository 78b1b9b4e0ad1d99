"""`python -m gymrl.report`: the command; the code is `gymrl.tracking.report`."""

from gymrl.tracking.report import main

if __name__ == "__main__":
    main()
