from mmcpu.gateway.app import main

main()
