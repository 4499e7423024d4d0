from .offline import main

main()
